"""The one exception type od-moe raises for user mistakes.

A `UserError` carries a message that says what went wrong and what to do; the CLI prints it on one line
and exits with code 2, the server turns it into an HTTP 4xx. Programming errors stay ordinary exceptions.
"""


class UserError(ValueError):
    """Bad input from the user: a missing path, a model with no MoE layer, an impossible capacity..."""
