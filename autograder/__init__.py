"""Decode Lab autograder: check functions shared by CI and the notebooks' hidden-test cells."""
