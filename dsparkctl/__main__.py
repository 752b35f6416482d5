from dsparkctl.cli.main import main

main()
