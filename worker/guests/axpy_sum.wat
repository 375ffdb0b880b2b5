;; Demo guest "well-behaved": y = a*x + y on two client buffers, then sum(y).
;;
;; run(x: handle, y: handle, n: i64, a: f32) -> (sum: f32, status: i32)
;;   copies x into a run-scoped scratch buffer through guest memory in 64 KiB
;;   chunks (read + write), runs axpy_f32(n, a, scratch, y) and sum_f32(y, n).
;;   status is 0, or the first negative tensorwasm error code met.
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "free" (func $free (param i64) (result i32)))
  (import "tensorwasm" "read" (func $read (param i64 i64 i32 i32) (result i32)))
  (import "tensorwasm" "write" (func $write (param i64 i64 i32 i32) (result i32)))
  (import "tensorwasm" "axpy_f32" (func $axpy (param i64 f32 i64 i64) (result i32)))
  (import "tensorwasm" "sum_f32" (func $sum (param i64 i64 i32) (result i32)))
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))

  ;; page 0: the sum's slot at 0 and messages; page 1: the copy chunk
  (memory (export "memory") 2 2)
  (data (i32.const 16) "axpy+sum done")

  (func (export "run") (param $x i64) (param $y i64) (param $n i64) (param $a f32) (result f32 i32)
    (local $t i64) (local $off i64) (local $bytes i64) (local $len i64) (local $rc i32)
    (local.set $bytes (i64.mul (local.get $n) (i64.const 4)))
    (local.set $t (call $alloc (local.get $bytes)))
    (if (i64.lt_s (local.get $t) (i64.const 0))
      (then (return (f32.const nan) (i32.wrap_i64 (local.get $t)))))
    ;; scratch = x, 64 KiB at a time through guest memory
    (block $copied
      (loop $chunk
        (br_if $copied (i64.ge_s (local.get $off) (local.get $bytes)))
        (local.set $len (i64.sub (local.get $bytes) (local.get $off)))
        (if (i64.gt_s (local.get $len) (i64.const 65536)) (then (local.set $len (i64.const 65536))))
        (local.set $rc (call $read (local.get $x) (local.get $off) (i32.const 65536) (i32.wrap_i64 (local.get $len))))
        (if (local.get $rc) (then (return (f32.const nan) (local.get $rc))))
        (local.set $rc (call $write (local.get $t) (local.get $off) (i32.const 65536) (i32.wrap_i64 (local.get $len))))
        (if (local.get $rc) (then (return (f32.const nan) (local.get $rc))))
        (local.set $off (i64.add (local.get $off) (local.get $len)))
        (br $chunk)))
    (local.set $rc (call $axpy (local.get $n) (local.get $a) (local.get $t) (local.get $y)))
    (if (local.get $rc) (then (return (f32.const nan) (local.get $rc))))
    (local.set $rc (call $sum (local.get $y) (local.get $n) (i32.const 0)))
    (if (local.get $rc) (then (return (f32.const nan) (local.get $rc))))
    (drop (call $free (local.get $t)))
    (drop (call $log (i32.const 16) (i32.const 13)))
    (f32.load (i32.const 0))
    (i32.const 0))
)
