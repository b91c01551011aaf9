//! tpuray's attribute macros: `#[tpuray::remote]` on functions and
//! `#[tpuray::actor]` on `impl` blocks (DESIGN.md §8).
//!
//! Both keep the user's item unchanged and add beside it:
//! - for `fn f`: a module `f` with `f::remote(args..) -> ObjectRef<T>`,
//!   `f::options(TaskOptions).remote(..)` and the registration of `f` in the
//!   binary's function table under `module_path!()::f` (the name a worker
//!   started from the same binary finds it by);
//! - for `impl C`: `C::remote(ctor args..) -> Result<CHandle>`,
//!   `C::options(ActorOptions)`, and `CHandle` with one method per `&self` /
//!   `&mut self` method returning `ObjectRef`s.
//!
//! Return types: `T` gives `ObjectRef<T>`; `Result<T, E>` gives
//! `ObjectRef<T>` and turns `Err(e)` into a task error carrying `e`'s
//! `Display`; `Generator<T>` makes a streaming task (an iterator of refs).

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::{format_ident, quote};
use syn::{
    FnArg, GenericArgument, ImplItem, ItemFn, ItemImpl, Pat, PathArguments, ReturnType, Type,
    parse_macro_input,
};

enum Ret {
    Unit,
    Plain(Type),
    Result(Type),
    Generator(Type),
}

fn last_segment_generic<'a>(ty: &'a Type, name: &str) -> Option<&'a Type> {
    let Type::Path(p) = ty else { return None };
    let seg = p.path.segments.last()?;
    if seg.ident != name {
        return None;
    }
    let PathArguments::AngleBracketed(a) = &seg.arguments else { return None };
    match a.args.first()? {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    }
}

fn classify(ret: &ReturnType) -> Ret {
    match ret {
        ReturnType::Default => Ret::Unit,
        ReturnType::Type(_, ty) => {
            if let Some(t) = last_segment_generic(ty, "Result") {
                Ret::Result(t.clone())
            } else if let Some(t) = last_segment_generic(ty, "Generator") {
                Ret::Generator(t.clone())
            } else {
                Ret::Plain((**ty).clone())
            }
        }
    }
}

/// (argument idents, argument types) of typed, non-receiver inputs.
fn typed_args<'a>(
    inputs: impl Iterator<Item = &'a FnArg>,
) -> syn::Result<(Vec<syn::Ident>, Vec<Type>)> {
    let mut names = Vec::new();
    let mut types = Vec::new();
    for (i, a) in inputs.enumerate() {
        if let FnArg::Typed(t) = a {
            let name = match &*t.pat {
                Pat::Ident(id) => id.ident.clone(),
                _ => format_ident!("__arg{}", i),
            };
            names.push(name);
            types.push((*t.ty).clone());
        }
    }
    Ok((names, types))
}

/// Tokens that encode the return value `r` of a call (in the executor).
fn encode_ret(ret: &Ret) -> TokenStream2 {
    match ret {
        Ret::Result(_) => quote! { ::tpuray::codec::encode_result(__r) },
        Ret::Generator(_) => quote! { ::tpuray::codec::encode_generator(__r) },
        Ret::Unit | Ret::Plain(_) => quote! { ::tpuray::codec::encode_value(&__r) },
    }
}

fn out_type(ret: &Ret) -> TokenStream2 {
    match ret {
        Ret::Unit => quote! { () },
        Ret::Plain(t) | Ret::Result(t) | Ret::Generator(t) => quote! { #t },
    }
}

/// Makes a plain function remote. See the crate docs.
#[proc_macro_attribute]
pub fn remote(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new(
            proc_macro2::Span::call_site(),
            "#[tpuray::remote] takes no arguments; pass options with f::options(TaskOptions { .. })",
        )
        .to_compile_error()
        .into();
    }
    let f = parse_macro_input!(item as ItemFn);
    match remote_fn(&f) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn remote_fn(f: &ItemFn) -> syn::Result<TokenStream2> {
    let name = &f.sig.ident;
    let vis = &f.vis;
    if let Some(FnArg::Receiver(r)) = f.sig.inputs.first() {
        return Err(syn::Error::new_spanned(
            r,
            "#[tpuray::remote] functions take no self; use #[tpuray::actor] on the impl block",
        ));
    }
    if !f.sig.generics.params.is_empty() {
        return Err(syn::Error::new_spanned(
            &f.sig.generics,
            "#[tpuray::remote] functions cannot be generic: workers find them by name",
        ));
    }
    if f.sig.asyncness.is_some() {
        return Err(syn::Error::new_spanned(
            f.sig.asyncness,
            "#[tpuray::remote] functions must be synchronous",
        ));
    }
    let (names, types) = typed_args(f.sig.inputs.iter())?;
    let idx: Vec<usize> = (0..names.len()).collect();
    let ret = classify(&f.sig.output);
    let out = out_type(&ret);
    let encode = encode_ret(&ret);
    let n = names.len();
    let (result_ty, submit) = match ret {
        Ret::Generator(_) => (
            quote! { ::tpuray::ObjectRefGenerator<#out> },
            quote! { ::tpuray::submit_streaming(NAME, __args, &self.0) },
        ),
        _ => (
            quote! { ::tpuray::ObjectRef<#out> },
            quote! { ::tpuray::submit_task(NAME, __args, &self.0) },
        ),
    };
    Ok(quote! {
        #f

        #[allow(non_snake_case, dead_code, clippy::all)]
        #vis mod #name {
            #[allow(unused_imports)]
            use super::*;

            /// The name workers find this function by.
            pub const NAME: &str = module_path!();

            /// Submits a call with these options.
            pub struct Remote(pub ::tpuray::TaskOptions);

            impl Remote {
                /// Submits the call; the result arrives through the returned ref.
                pub fn remote(&self, #(#names: impl ::tpuray::IntoArg<#types>),*) -> #result_ty {
                    let __args = vec![#(::tpuray::IntoArg::<#types>::into_arg(#names)),*];
                    #submit
                }
            }

            /// Submits a call with default options (1 CPU, 3 retries).
            pub fn remote(#(#names: impl ::tpuray::IntoArg<#types>),*) -> #result_ty {
                Remote(::tpuray::TaskOptions::default()).remote(#(#names),*)
            }

            /// Options for the next call: resources, retries, scheduling.
            pub fn options(options: ::tpuray::TaskOptions) -> Remote {
                Remote(options)
            }

            fn __invoke(__args: &[::tpuray::codec::ArgBytes]) -> ::std::result::Result<::tpuray::codec::Encoded, ::tpuray::TaskFailure> {
                ::tpuray::codec::check_arity(NAME, __args.len(), #n)?;
                #(let #names: #types = ::tpuray::codec::decode_arg(NAME, #idx, &__args[#idx])?;)*
                let __r = super::#name(#(#names),*);
                #encode
            }

            ::tpuray::inventory::submit! {
                ::tpuray::registry::RemoteFunction { name: NAME, invoke: __invoke }
            }
        }
    })
}

/// Makes the methods of an `impl` block callable on a remote actor. See the
/// crate docs.
#[proc_macro_attribute]
pub fn actor(attr: TokenStream, item: TokenStream) -> TokenStream {
    if !attr.is_empty() {
        return syn::Error::new(
            proc_macro2::Span::call_site(),
            "#[tpuray::actor] takes no arguments",
        )
        .to_compile_error()
        .into();
    }
    let imp = parse_macro_input!(item as ItemImpl);
    match actor_impl(&imp) {
        Ok(t) => t.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn actor_impl(imp: &ItemImpl) -> syn::Result<TokenStream2> {
    if imp.trait_.is_some() {
        return Err(syn::Error::new_spanned(
            imp,
            "#[tpuray::actor] goes on an inherent impl block, not a trait impl",
        ));
    }
    let Type::Path(tp) = &*imp.self_ty else {
        return Err(syn::Error::new_spanned(&imp.self_ty, "#[tpuray::actor] needs a named type"));
    };
    let class = tp.path.segments.last().expect("path has a segment").ident.clone();
    let handle = format_ident!("{}Handle", class);
    let hidden = format_ident!("__tpuray_actor_{}", class);
    let mut ctor = None;
    let mut methods = Vec::new();
    for item in &imp.items {
        let ImplItem::Fn(m) = item else { continue };
        if !matches!(m.vis, syn::Visibility::Public(_)) {
            continue;
        }
        match m.sig.inputs.first() {
            Some(FnArg::Receiver(r)) => {
                if r.reference.is_none() {
                    return Err(syn::Error::new_spanned(
                        r,
                        "actor methods take &self or &mut self",
                    ));
                }
                methods.push(m);
            }
            _ => {
                let returns_self = match &m.sig.output {
                    ReturnType::Type(_, t) => {
                        matches!(&**t, Type::Path(p) if p.path.is_ident("Self") || p.path.segments.last().is_some_and(|s| s.ident == class))
                    }
                    ReturnType::Default => false,
                };
                if returns_self {
                    if ctor.is_some() {
                        return Err(syn::Error::new_spanned(
                            &m.sig,
                            "#[tpuray::actor] needs exactly one public constructor returning Self",
                        ));
                    }
                    ctor = Some(m);
                }
            }
        }
    }
    let Some(ctor) = ctor else {
        return Err(syn::Error::new_spanned(
            imp,
            "#[tpuray::actor] needs a public constructor returning Self (e.g. `pub fn new(..) -> Self`)",
        ));
    };
    let ctor_name = &ctor.sig.ident;
    let (cnames, ctypes) = typed_args(ctor.sig.inputs.iter())?;
    let cidx: Vec<usize> = (0..cnames.len()).collect();
    let cn = cnames.len();

    let mut handle_methods = Vec::new();
    let mut invokers = Vec::new();
    let mut table = Vec::new();
    for m in &methods {
        let mname = &m.sig.ident;
        let mname_str = mname.to_string();
        let (names, types) = typed_args(m.sig.inputs.iter().skip(1))?;
        let idx: Vec<usize> = (0..names.len()).collect();
        let n = names.len();
        let ret = classify(&m.sig.output);
        let out = out_type(&ret);
        let encode = encode_ret(&ret);
        let inv = format_ident!("__invoke_{}", mname);
        let (result_ty, submit) = match ret {
            Ret::Generator(_) => (
                quote! { ::tpuray::ObjectRefGenerator<#out> },
                quote! { self.0.call_streaming(#mname_str, __args) },
            ),
            _ => (quote! { ::tpuray::ObjectRef<#out> }, quote! { self.0.call(#mname_str, __args) }),
        };
        let mutability = match &m.sig.inputs.first() {
            Some(FnArg::Receiver(r)) if r.mutability.is_some() => quote! { &mut *__this },
            _ => quote! { &*__this },
        };
        handle_methods.push(quote! {
            /// Calls the actor method; calls from one caller run in order.
            pub fn #mname(&self, #(#names: impl ::tpuray::IntoArg<#types>),*) -> #result_ty {
                let __args = vec![#(::tpuray::IntoArg::<#types>::into_arg(#names)),*];
                #submit
            }
        });
        invokers.push(quote! {
            fn #inv(__state: &mut (dyn ::std::any::Any + Send), __args: &[::tpuray::codec::ArgBytes]) -> ::std::result::Result<::tpuray::codec::Encoded, ::tpuray::TaskFailure> {
                let __name = concat!(module_path!(), "::", stringify!(#class), ".", #mname_str);
                ::tpuray::codec::check_arity(__name, __args.len(), #n)?;
                #(let #names: #types = ::tpuray::codec::decode_arg(__name, #idx, &__args[#idx])?;)*
                let __this: &mut #class = __state.downcast_mut::<#class>().expect("actor state has the actor's type");
                let __r = #class::#mname(#mutability, #(#names),*);
                #encode
            }
        });
        table.push(quote! { (#mname_str, #hidden::#inv as ::tpuray::registry::MethodFn) });
    }

    Ok(quote! {
        #imp

        /// A handle to a remote actor; clone it freely, pass it to tasks.
        #[derive(Clone, ::tpuray::serde::Serialize, ::tpuray::serde::Deserialize)]
        #[serde(crate = "::tpuray::serde")]
        pub struct #handle(pub ::tpuray::ActorHandle);

        impl #handle {
            /// The untyped handle (id, name, kill).
            pub fn handle(&self) -> &::tpuray::ActorHandle {
                &self.0
            }
            #(#handle_methods)*
        }

        impl #class {
            /// The name workers find this actor class by.
            pub const TPURAY_CLASS: &'static str = concat!(module_path!(), "::", stringify!(#class));

            /// Creates the actor with default options; waits until it is placed.
            pub fn remote(#(#cnames: impl ::tpuray::IntoArg<#ctypes>),*) -> ::std::result::Result<#handle, ::tpuray::Error> {
                Self::options(::tpuray::ActorOptions::default()).remote(#(#cnames),*)
            }

            /// Creation options: name, resources, restarts, concurrency.
            pub fn options(options: ::tpuray::ActorOptions) -> #hidden::Creator {
                #hidden::Creator(options)
            }
        }

        #[allow(non_snake_case, dead_code, clippy::all)]
        #[doc(hidden)]
        pub mod #hidden {
            #[allow(unused_imports)]
            use super::*;

            pub struct Creator(pub ::tpuray::ActorOptions);

            impl Creator {
                /// Creates the actor; waits until it is placed.
                pub fn remote(&self, #(#cnames: impl ::tpuray::IntoArg<#ctypes>),*) -> ::std::result::Result<#handle, ::tpuray::Error> {
                    let __args = vec![#(::tpuray::IntoArg::<#ctypes>::into_arg(#cnames)),*];
                    ::tpuray::create_actor(#class::TPURAY_CLASS, __args, &self.0).map(#handle)
                }
            }

            fn __construct(__args: &[::tpuray::codec::ArgBytes]) -> ::std::result::Result<Box<dyn ::std::any::Any + Send>, ::tpuray::TaskFailure> {
                let __name = #class::TPURAY_CLASS;
                ::tpuray::codec::check_arity(__name, __args.len(), #cn)?;
                #(let #cnames: #ctypes = ::tpuray::codec::decode_arg(__name, #cidx, &__args[#cidx])?;)*
                Ok(Box::new(#class::#ctor_name(#(#cnames),*)))
            }

            #(#invokers)*

            ::tpuray::inventory::submit! {
                ::tpuray::registry::ActorClass {
                    name: #class::TPURAY_CLASS,
                    construct: __construct,
                    methods: &[#(#table),*],
                }
            }
        }
    })
}
