"""A model zoo for the alignment checker: the same models in Keras and torch, with their expected findings."""
