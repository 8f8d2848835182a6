from ampdoctor.cli.app import main

main()
