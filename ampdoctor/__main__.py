from ampdoctor.cli import main

main()
