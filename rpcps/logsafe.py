"""Placeholder: replaced by the logs branch."""


def peer_text(value: object, limit: int = 200) -> str:
    text = str(value)
    out = repr(text[:limit])[1:-1]
    return out + ("..." if len(text) > limit else "")
