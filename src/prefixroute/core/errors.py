"""Typed errors of the core. Edges turn them into messages (CLI: exit code 2; HTTP: 4xx)."""


class PrefixRouteError(Exception):
    """Base of every error the library raises on purpose."""


class ConfigError(PrefixRouteError, ValueError):
    """A parameter is out of range or unknown (block size below 1, negative capacity, ...)."""


class InputError(PrefixRouteError, ValueError):
    """Input data is malformed. ``where`` names the file and line, ``field`` the field."""

    def __init__(self, message: str, where: str | None = None, field: str | None = None):
        self.where = where
        self.field = field
        prefix = f"{where}: " if where else ""
        suffix = f" (field {field!r})" if field else ""
        super().__init__(f"{prefix}{message}{suffix}")
