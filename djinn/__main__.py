from djinn.cli.main import main

main()
