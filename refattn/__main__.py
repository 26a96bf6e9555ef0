"""``python3 -m refattn``: the ``refattn`` command line (:func:`refattn_cli.main`)."""

if __name__ == "__main__":
    from refattn_cli import main

    raise SystemExit(main())
