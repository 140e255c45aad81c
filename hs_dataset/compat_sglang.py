"""What hs_dataset knows about SGLang versions, in one place (the plugin and the backend import it).

Imports nothing: the plugin loads it in SGLang's scheduler process before SGLang is checked.
"""

from __future__ import annotations

__all__ = ["MIN_SGLANG", "SUPPORTED_SGLANG", "TESTED_SGLANG", "sglang_version_tuple"]

MIN_SGLANG = (0, 5, 11)  # the first release with the plugin framework (entry points + HookRegistry)
TESTED_SGLANG = "0.5.17"  # what the GPU suite ran on
SUPPORTED_SGLANG = f"{'.'.join(map(str, MIN_SGLANG))} - {TESTED_SGLANG}"


def sglang_version_tuple(version: str) -> tuple[int, ...]:
    """``"0.5.17.post1"`` -> ``(0, 5, 17)``."""
    out = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)
