"""minidp's benchmarks: a package, so that they share settings by name (``from .common import ...``)."""
