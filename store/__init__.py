"""Tables, migrations, and the only code in Reverie that issues queries."""
