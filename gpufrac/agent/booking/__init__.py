"""Who holds which part of which GPU: bookings, their state file, and the kubelet's view.

ledger              the ledger: every container's booking, checked and kept on the loop
ledger_store        the ledger's state file format
persist             when the state file is saved (batched, on the loop)
container_dirs      each container's directory (config, usage), made and deleted off the loop
placement           which slices a new container should get
allocation_service  the Backend both front ends adapt: preferred, allocate, prestart;
                    prepare_claims, unprepare_claims, device_health (the DRA driver)
reconcile           releasing what pod-resources no longer lists
pods                which pod and container a booking is, and its annotations applied
claims              the DRA driver's claims: prepared (booked from the claim), unprepared, checked
claim_identity      a claim's policy from its parameters, and the containers it serves
cdi                 the CDI spec of a prepared claim: its GPU, the shim, its directory
"""
