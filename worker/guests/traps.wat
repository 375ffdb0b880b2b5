;; Test guest: each way a run can end badly, one export each.
(module
  (memory (export "memory") 1)
  (func (export "unreachable") unreachable)
  (func $recurse (export "recurse") (param i64) (result i64)
    (i64.add (call $recurse (i64.add (local.get 0) (i64.const 1))) (i64.const 1)))
  (func (export "spin") (loop $l (br $l)))
  ;; memory.grow by n pages: the old size in pages, or -1 past the store's limit
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
  (func (export "pages") (result i32) (memory.size))
  (func (export "oob") (result i32) (i32.load (i32.const -4)))
  (func (export "div") (param i32) (result i32) (i32.div_s (i32.const 1) (local.get 0)))
  (func (export "ok") (result i32) (i32.const 42))
)
