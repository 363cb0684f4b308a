"""`python -m model_server`: the Wick model server's command line."""

from model_server.entrypoints.cli import main

if __name__ == "__main__":
    main()
