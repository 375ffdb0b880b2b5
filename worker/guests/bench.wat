;; Benchmark guest (twt bench wasm).
;;   nop()                           a trivial export: the run_wasm round trip
;;   calls(n) -> i64                 n host calls (free of an unknown handle: all check, no work)
;;   axpy_loop(x, y, n, a, reps)     reps x axpy_f32(n, a, x, y) on client buffers
;;   matmul_loop(a, b, c, n, reps)   reps x matmul_f32(a, b, c, n, n, n): C = A @ B, n x n, client buffers
(module
  (import "tensorwasm" "free" (func $free (param i64) (result i32)))
  (import "tensorwasm" "axpy_f32" (func $axpy (param i64 f32 i64 i64) (result i32)))
  (import "tensorwasm" "matmul_f32" (func $matmul (param i64 i64 i64 i64 i64 i64) (result i32)))

  (func (export "nop"))

  (func (export "calls") (param $n i64) (result i64) (local $i i64)
    (block $done
      (loop $l
        (br_if $done (i64.ge_s (local.get $i) (local.get $n)))
        (drop (call $free (i64.const 0)))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $l)))
    (local.get $i))

  (func (export "axpy_loop") (param $x i64) (param $y i64) (param $n i64) (param $a f32) (param $reps i64) (result i32)
    (local $i i64) (local $rc i32)
    (block $done
      (loop $l
        (br_if $done (i64.ge_s (local.get $i) (local.get $reps)))
        (local.set $rc (call $axpy (local.get $n) (local.get $a) (local.get $x) (local.get $y)))
        (if (local.get $rc) (then (return (local.get $rc))))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $l)))
    (i32.const 0))

  (func (export "matmul_loop") (param $a i64) (param $b i64) (param $c i64) (param $n i64) (param $reps i64)
    (result i32)
    (local $i i64) (local $rc i32)
    (block $done
      (loop $l
        (br_if $done (i64.ge_s (local.get $i) (local.get $reps)))
        (local.set $rc (call $matmul (local.get $a) (local.get $b) (local.get $c)
                                     (local.get $n) (local.get $n) (local.get $n)))
        (if (local.get $rc) (then (return (local.get $rc))))
        (local.set $i (i64.add (local.get $i) (i64.const 1)))
        (br $l)))
    (i32.const 0))
)
