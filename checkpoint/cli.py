"""CLI of this component (filled in by the component)."""


def register(sub):
    pass
