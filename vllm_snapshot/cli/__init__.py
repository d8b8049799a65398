"""The command line: the typer app, rendering of results, doctor and demo. The only layer that
prints results and turns errors into exit codes. Imports the operations and below."""
