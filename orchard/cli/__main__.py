from orchard.cli.main import main

main()
