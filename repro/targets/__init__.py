"""Engine adapters: everything engine-specific (launch command, endpoints, process titles, sites) lives here."""
