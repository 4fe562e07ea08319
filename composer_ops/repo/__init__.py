"""The repository: every SQL statement the engine runs, split per aggregate.

Functions take the connection to run on and never commit or log (the seed's rules).
"""
