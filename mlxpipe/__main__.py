"""The ``mlxpipe`` command and ``python -m mlxpipe``: the process around :func:`mlxpipe.cli.main`.

Signals come first: until a run has a record to finish, SIGINT and SIGTERM keep their default action, so
Ctrl-C during the imports or the model's load ends the process at once, quietly, "killed by SIGINT" (Python's
own handler would raise KeyboardInterrupt inside whatever import is under way: a traceback). The run installs
its handlers once the model is loaded (:mod:`mlxpipe.cli.signals`), and a run a signal stopped ends the
process by that signal again (:func:`mlxpipe.cli.signals.exit_process`), so a shell loop stops too.
A signal the parent left ignored stays ignored: a shell starts ``mlxpipe … &`` with SIGINT ignored, so that
the terminal's Ctrl-C is not meant for it, and ``nohup`` ignores SIGHUP.
"""

import signal


def entry() -> None:
    """Run the command line and end the process the Unix way (see the module docstring)."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # (SIGHUP's default ends it too)
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    from .cli.main import main
    from .cli.signals import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
