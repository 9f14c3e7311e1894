from changeover.cli import main

main()
