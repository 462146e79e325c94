"""`degs eval` and `degs analyze` subcommands (registered by degs_jax.cli)."""


def add_commands(sub, add_model_args, add_decoder_args, hyperparameters, load_model) -> None:
    """Register the evaluation subcommands on the `degs` subparsers object."""
