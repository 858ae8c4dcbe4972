from reshard_cli.cli import main

main()
