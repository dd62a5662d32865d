"""The drafter's training prompts never contain a held-out prompt, subject or template, so the
acceptance rate measured on `eval_prompts` is measured on text the drafter was not trained on."""

import re

import pytest

from decodelab.training import chat_prompts
from decodelab.training.chat_prompts import broad_train_prompts, eval_prompts, train_prompts


@pytest.fixture(scope="module")
def training() -> list[str]:
    return train_prompts() + broad_train_prompts()


def test_sets_are_distinct_and_large(training):
    assert len(set(train_prompts())) > 1000 and len(set(broad_train_prompts())) > 900
    assert not set(train_prompts()) & set(broad_train_prompts())
    assert len(eval_prompts()) == 24


def test_no_held_out_prompt_subject_or_template_is_trained_on(training):
    lowered = [p.lower() for p in training]
    assert not set(eval_prompts()) & set(training)
    for subject in chat_prompts._items(chat_prompts.EVAL_TOPICS):
        pattern = re.compile(rf"\b{re.escape(subject.lower())}\b")
        assert not [p for p in lowered if pattern.search(p)], subject
    for template in chat_prompts.EVAL_TEMPLATES:
        frame = template.split("{x}")[0]
        assert not [p for p in training if p.startswith(frame)], template


def test_prompts_are_reproducible():
    assert broad_train_prompts() == broad_train_prompts() and train_prompts() == train_prompts()
