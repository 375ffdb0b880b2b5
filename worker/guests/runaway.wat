;; Demo guest "runaway": never returns; its deadline (epoch interruption) stops it.
;;
;; run() -> ()   traps with KernelTimeout after the tenant's wasm_timeout_s
;;               (or out_of_fuel first if the fuel runs out before the deadline)
(module
  (func (export "run")
    (loop $forever (br $forever)))
)
