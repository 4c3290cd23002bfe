"""minidp's tests: a package, so that test modules import their shared helpers by name (``from .helpers import ...``)."""
