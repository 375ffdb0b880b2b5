;; Demo guest "long job": real work that takes a while, used to kill its worker mid-run.
;;
;; run(n: i64, reps: i64) -> f32
;;   x = alloc(4n) filled with 1.0, y = alloc(4n) filled with 0.0,
;;   reps times y += 0.5 * x, returns sum(y) = 0.5 * reps * n.
;;   The allocations come first, so a watcher sees the run start in the
;;   tenant's GPU counter. Errors return NaN.
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "fill_f32" (func $fill (param i64 f32 i64) (result i32)))
  (import "tensorwasm" "axpy_f32" (func $axpy (param i64 f32 i64 i64) (result i32)))
  (import "tensorwasm" "sum_f32" (func $sum (param i64 i64 i32) (result i32)))

  (memory (export "memory") 1 1)

  (func (export "run") (param $n i64) (param $reps i64) (result f32)
    (local $x i64) (local $y i64) (local $i i64)
    (local.set $x (call $alloc (i64.mul (local.get $n) (i64.const 4))))
    (local.set $y (call $alloc (i64.mul (local.get $n) (i64.const 4))))
    (if (i64.lt_s (i64.or (local.get $x) (local.get $y)) (i64.const 0)) (then (return (f32.const nan))))
    (if (call $fill (local.get $x) (f32.const 1) (local.get $n)) (then (return (f32.const nan))))
    (if (call $fill (local.get $y) (f32.const 0) (local.get $n)) (then (return (f32.const nan))))
    (block $done
      (loop $rep
        (br_if $done (i64.ge_s (local.get $i) (local.get $reps)))
        (if (call $axpy (local.get $n) (f32.const 0.5) (local.get $x) (local.get $y)) (then (return (f32.const nan))))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $rep)))
    (if (call $sum (local.get $y) (local.get $n) (i32.const 0)) (then (return (f32.const nan))))
    (f32.load (i32.const 0)))
)
