"""Offline training: the tiny target/draft pair (train_tiny), the SmolLM2 feature drafter
(train_eagle) and its prompts (chat_prompts). Nothing else in the package imports it."""
