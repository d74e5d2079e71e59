"""The one exception type for mistakes a user can fix (bad paths, bad settings, bad checkpoints).

The CLI prints these as a single line and exits non-zero, without a traceback; anything else is a bug.
"""


class UserError(ValueError):
    """Something the user asked for cannot be done; the message says what was wrong and what to do."""
