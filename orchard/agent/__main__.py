from orchard.agent.main import main

main()
