"""One module of checks per notebook; each check takes the function under test and raises AssertionError."""
