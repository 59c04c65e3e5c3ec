"""SQL migrations of the read models, applied in file-name order by eventstore.migrate."""
