"""`python -m model_server`: the Wick model server's command line."""

from model_server.openmp_env import set_openmp_wait_defaults

if __name__ == "__main__":
    set_openmp_wait_defaults()  # before the CLI imports torch
    from model_server.entrypoints.cli import main

    main()
