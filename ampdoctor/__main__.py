from ampdoctor.cli.main import main

main()
