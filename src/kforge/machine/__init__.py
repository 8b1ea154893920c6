"""`kforge machine PROBLEM`: a language model writes kernels, and kforge's judge grades them.

    prompt.py    the first prompt (the reference, the backend, the device, the roofline) and the feedback
    client.py    replies from an OpenAI-compatible endpoint, or from files a person writes (manual mode)
    extract.py   the one fenced block of a reply that defines ModelNew
    checks.py    static flags for known tricks (recorded, never a verdict)
    loop.py      samples and turns, the judge in isolated workers, the store of attempts, pass@k

See docs/machine.md.
"""
