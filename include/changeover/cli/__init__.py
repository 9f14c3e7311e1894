"""The `changeover` command (`commands`; its Typer apps in `app`, its commands in a module per family, `*_commands`),
the demo, the local Airflow it starts, and the demo's click generator."""


def main() -> None:
    """The console script's entry point; the commands load on use, so the demo's helpers import without them."""
    from changeover.cli.commands import main as run

    run()
