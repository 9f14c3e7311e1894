"""Names that end up in paths, URLs and SQL rows must be plain."""

import re

from changeover.errors import ChangeoverError

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def is_safe(name: str) -> bool:
    return bool(_SAFE.match(name)) and ".." not in name


def check_name(kind: str, name: str) -> str:
    if not is_safe(name):
        raise ChangeoverError(
            f"{kind} name {name!r}",
            "names may only hold letters, digits, '.', '_' and '-', must not contain '/' or '..' "
            "and must start with a letter or digit",
            f"choose a name such as {re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('.-') or 'my-name'!r}",
        )
    return name
