from devplace.cli import main

main()
