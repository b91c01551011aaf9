"""The state API's errors (Ray's ``ray.util.state.exception``)."""


class RayStateApiException(Exception):
    """The state API could not answer completely (a failed or truncated query)."""


class ServerUnavailable(RayStateApiException):
    """The head's state API could not be reached."""
