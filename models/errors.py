"""The one exception type whose message is meant for the user: it says what went wrong and what to do."""


def last_line(err: BaseException) -> str:
    """The last line of an error's message ("" for none): where transformers and its validators put the reason."""
    text = str(err).strip()
    return text.splitlines()[-1].strip() if text else ""


class UserFacingError(Exception):
    """Raised where a problem is detected; the CLI prints it on one line, the UI shows it as is."""
