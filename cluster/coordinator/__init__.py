"""The coordinator actor of a replica that runs Ray workers: the process where its engine core runs,
beside rank 0 (actor.py). Front ends reach it through warpspec.client's RayCoreClient."""
