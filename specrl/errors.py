"""Errors caused by user input (config, model path, dataset, reward function). The CLI prints
their message as one line and exits non-zero; anything else is a bug and keeps its traceback."""


class UserError(ValueError):
    """A problem with what the user gave us, with a message naming it and the fix."""
