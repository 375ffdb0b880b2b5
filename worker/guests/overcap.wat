;; Demo guest "over its cap": a small allocation that fits, then one that does not.
;;
;; run(small: i64, big: i64) -> i64
;;   returns the second alloc's result: a negative tensorwasm error code
;;   (-5, GPU_QUOTA, when the tenant's GPU cap refuses it), or a handle if
;;   it unexpectedly fit. The first failure code is returned as is.
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "fill_f32" (func $fill (param i64 f32 i64) (result i32)))
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))

  (memory (export "memory") 1 1)
  (data (i32.const 0) "second alloc refused: GPU quota exhausted (-5)")

  (func (export "run") (param $small i64) (param $big i64) (result i64)
    (local $h1 i64) (local $h2 i64)
    (local.set $h1 (call $alloc (local.get $small)))
    (if (i64.lt_s (local.get $h1) (i64.const 0)) (then (return (local.get $h1))))
    (drop (call $fill (local.get $h1) (f32.const 1) (i64.div_u (local.get $small) (i64.const 4))))
    (local.set $h2 (call $alloc (local.get $big)))
    (if (i64.eq (local.get $h2) (i64.const -5))
      (then (drop (call $log (i32.const 0) (i32.const 46)))))
    (local.get $h2))
)
