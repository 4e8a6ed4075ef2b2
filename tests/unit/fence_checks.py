"""What every fence's test checks first: the version it was checked on, and that each fenced name still exists."""

import warnings


def check_recorded_version(library: str, installed: str, checked: str, fence: str) -> None:
    """`checked` is a full version; a warning (not a failure) where another one is installed: the fence's other
    tests say whether anything it uses changed."""
    assert checked.count(".") == 2
    if installed.split("+")[0] != checked:
        warnings.warn(f"{library} {installed} is installed; {fence} was checked against {checked}: the tests below"
                      " say whether anything it uses changed.")


def check_attribute_path(owner, path: str, where: str) -> None:
    """Each dotted part of `path` exists on the one before it, from `owner`."""
    for name in path.split("."):
        assert hasattr(owner, name), f"{where}.{path} is gone"
        owner = getattr(owner, name)
