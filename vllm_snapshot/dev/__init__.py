"""Development aids that ship with the package (the tiny test model). Imports only the base modules."""
