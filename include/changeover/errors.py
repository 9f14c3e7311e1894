"""One error type whose message always says what was refused, why, and what to do instead."""


class ChangeoverError(Exception):
    def __init__(self, refused: str, reason: str, fix: str) -> None:
        self.refused = refused
        self.reason = reason
        self.fix = fix
        super().__init__(f"{refused}: {reason}. {fix}")


class NeedsOperator(ChangeoverError):
    """A refusal that retrying cannot change: a person has to act first (an orchestrator fails it at once)."""
