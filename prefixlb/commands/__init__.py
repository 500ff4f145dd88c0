"""One module per `prefixlb` subcommand, each with `main(argv) -> int`."""
