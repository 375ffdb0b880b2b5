;; Test and tool guest: every tensorwasm import re-exported one to one, so a
;; caller can drive each with any argument (the ABI tests do, with hostile ones),
;; plus a few helpers. Memory: 1 page, growable to 4.
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "free" (func $free (param i64) (result i32)))
  (import "tensorwasm" "write" (func $write (param i64 i64 i32 i32) (result i32)))
  (import "tensorwasm" "read" (func $read (param i64 i64 i32 i32) (result i32)))
  (import "tensorwasm" "fill_f32" (func $fill (param i64 f32 i64) (result i32)))
  (import "tensorwasm" "axpy_f32" (func $axpy (param i64 f32 i64 i64) (result i32)))
  (import "tensorwasm" "sum_f32" (func $sum (param i64 i64 i32) (result i32)))
  (import "tensorwasm" "log" (func $log (param i32 i32) (result i32)))

  (memory (export "memory") 1 4)

  (func (export "alloc") (param i64) (result i64) (call $alloc (local.get 0)))
  (func (export "free") (param i64) (result i32) (call $free (local.get 0)))
  (func (export "write") (param i64 i64 i32 i32) (result i32)
    (call $write (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "read") (param i64 i64 i32 i32) (result i32)
    (call $read (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "fill_f32") (param i64 f32 i64) (result i32)
    (call $fill (local.get 0) (local.get 1) (local.get 2)))
  (func (export "axpy_f32") (param i64 f32 i64 i64) (result i32)
    (call $axpy (local.get 0) (local.get 1) (local.get 2) (local.get 3)))
  (func (export "sum_f32") (param i64 i64 i32) (result i32)
    (call $sum (local.get 0) (local.get 1) (local.get 2)))
  (func (export "log") (param i32 i32) (result i32) (call $log (local.get 0) (local.get 1)))

  ;; helpers
  (func (export "grow") (param i32) (result i32) (memory.grow (local.get 0)))
  (func (export "load_f32") (param i32) (result f32) (f32.load (local.get 0)))
  (func (export "add") (param i32 i32) (result i32) (i32.add (local.get 0) (local.get 1)))
)
