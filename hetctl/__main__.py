from hetctl.cli import main

main()
