"""Errors caused by user input (config, model path, dataset, reward function). The CLI prints
their message as one line and exits non-zero; anything else is a bug and keeps its traceback."""


class UserError(ValueError):
    """A problem with what the user gave us, with a message naming it and the fix."""


def first_line(err: Exception) -> str:
    """The first line of an exception's message (libraries' messages can run to pages)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
