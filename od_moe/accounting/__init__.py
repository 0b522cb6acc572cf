"""Accounting: the ledger every reported count lives in (`ledger.py`), and the plain-text tables made from it
(`report.py`).

Not here: what is counted (the runtimes book into the ledger), or the server's pages (`server/`).
"""
