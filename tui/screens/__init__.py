"""One screen per view of a plan; each is a Textual mode of ``dctms.tui.app.InspectorApp``."""
