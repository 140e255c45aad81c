"""The fixtures every test may use, each defined once, in its own module (pytest plugins)."""

pytest_plugins = ["tests.fixtures.models", "tests.fakehub.fixtures", "tests.gpu.models"]
